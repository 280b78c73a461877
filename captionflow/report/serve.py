"""The output root over HTTP, read only, so that the report link in the Prefect UI opens (``report_url``; a browser
refuses file:// links from a web page): ``captionflow reports --output ROOT --port 8080``. GET and HEAD of files
under the root, no directory listings, no writes; what is served is what the root holds (reports, captions,
scores), to whoever reaches the port: bind it where the team's browsers are, not on the internet."""

from __future__ import annotations

import functools
import http.server
from pathlib import Path


class ReadOnlyFiles(http.server.SimpleHTTPRequestHandler):
    """Files under ``directory``; a folder is not listed (403)."""

    def list_directory(self, path):
        self.send_error(403, "no listings: open a report's own link")
        return None

    def log_message(self, format, *args):  # one line a request is the server's log, not the run's
        pass


def report_server(root: str, host: str = "127.0.0.1", port: int = 8080) -> http.server.ThreadingHTTPServer:
    """A server of the local folder ``root`` (not started: ``serve_forever``); ValueError for a root that is no
    folder."""
    folder = Path(root).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"reports: the output root {root!r} is not a local folder")
    return http.server.ThreadingHTTPServer((host, port), functools.partial(ReadOnlyFiles, directory=str(folder)))
