"""The warm engine service (``captionflow serve``): engines that outlive runs and swap checkpoints. controller.py
starts, finds and stops it (a detached controller actor and the engines' Serve applications); replica.py is what
runs inside an engine's replica; runs.py is a run's lease on it; feed.py hands a run's request blocks to the engines;
address.py is where a service on this machine can be reached."""
