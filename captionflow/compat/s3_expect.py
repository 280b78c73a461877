"""S3 uploads without ``Expect: 100-continue``, so that an endpoint that never answers cannot hang a write.

Works around: botocore adds ``Expect: 100-continue`` to every S3 request with a body, and aiobotocore (under
s3fs) then waits for the server's "100 Continue" with no timeout at all: against an endpoint that accepts
the connection and says nothing, a PUT hangs forever, while reads give up after ``read_timeout``. Without
the header, a PUT's response is read under ``read_timeout`` like every other call. The header only saves
sending a large body that the server would refuse; captionflow's uploads are small shards.
Can go when aiobotocore applies its read timeout to the wait for "100 Continue".
"""

from __future__ import annotations


def drop_expect_header() -> None:
    """Take botocore's expect-header handler out of the handlers every new session starts with."""
    try:
        import botocore.handlers as handlers
    except ImportError:
        return
    handlers.BUILTIN_HANDLERS[:] = [
        entry for entry in handlers.BUILTIN_HANDLERS if getattr(entry[1], "__name__", "") != "add_expect_header"
    ]
