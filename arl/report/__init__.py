"""What a run leaves for people to look at: experiment trackers (`trackers`), trajectory traces (`traces`) and the
run report page (`page`). Nothing here imports zmq; each tracker library is imported only when it is chosen."""
