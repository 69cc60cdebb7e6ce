"""The run's own services, around the training it drives: where it writes and whether it may, what it prints,
and which code ran.

    folder.py        the run folder: the default name, the paths in it, the local folder a URL --logs stages
                     in, and the checks that a new run takes no other run's folder (local, and the remote store's
                     preflight)
    console.py       OpenCLIP-style console lines and out.log, every line with URLs redacted
    code_version.py  the git commit of the bigclip checkout that ran (params.yaml)
    stack_dumps.py   `kill -USR2 <pid>` prints a stuck process's Python stacks (installed by launch/train.py)
"""
