"""What DeepSpeed's ``deepspeed`` launcher does per rank that torch.distributed.run does not: it passes
``--local_rank=<LOCAL_RANK>`` to the script (the clients' argument parsers read it; DS-Chat initialises
the process group only when it is set). Usage on each rank (torch.distributed.run starts it):

    python ds_launch.py [--register] SCRIPT ARGS...

With ``--register``, zerodp is registered as the ``deepspeed`` module first (``zerodp run``'s opt-in
mechanism, :func:`zerodp.app.run_script.run_worker`), for clients whose libraries import
``deepspeed`` themselves (transformers' ZeRO-3 ``from_pretrained``). SCRIPT runs as ``__main__``.
"""

import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    register = argv[:1] == ["--register"]
    if register:
        argv = argv[1:]
    script, args = argv[0], [*argv[1:], f"--local_rank={os.environ['LOCAL_RANK']}"]
    if register:
        from zerodp.app.run_script import run_worker

        run_worker(script, args)
        return
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
