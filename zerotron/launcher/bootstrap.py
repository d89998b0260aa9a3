"""What every worker process runs first: tie its life to its launcher's, bind it to its cores, then
``exec`` the program (same process, same PID), so the program runs exactly as it would directly.

    python -m zerotron.launcher.bootstrap --parent PID [--cpus "0,4;1,5"] [--membind "0;1"]
        [--numactl PATH] -- -u train.py --local_rank=0 ...

- **Never outlive the launcher.** ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this
  process the moment its parent dies, for any reason, SIGKILL included (nothing the launcher does
  on its way out can be relied on then). The setting survives ``exec``. Then, if the parent is
  already not ``PID`` (the launcher died between fork and prctl), the worker kills itself.
  The kernel ties the signal to the *thread* that forked the worker, not to the process: the
  launcher starts its workers from the thread that runs the elastic agent (``agent.run()``, which
  blocks until every worker is gone), so that thread outlives them in every normal run. Setting
  it here, rather than in a ``preexec_fn`` of the agent's ``Popen`` (which torch does not let us
  pass), needs no change to torch and does it in a single-threaded process.
- **Cores.** ``--cpus`` lists each local rank's CPU set (``;`` between ranks, index
  ``LOCAL_RANK``); the worker binds itself with ``os.sched_setaffinity`` (kept across ``exec``).
  ``--membind`` gives each rank's NUMA node (empty: none) and ``--numactl`` the tool that binds
  its memory there: then the program is started through ``numactl --membind=N``.

Only the standard library is imported: this runs before every worker, and must stay quick.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (``parent``) dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # the launcher died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--key value`` pairs up to ``--``, and the interpreter arguments after it."""
    if "--" not in argv:
        raise SystemExit("zerotron.launcher.bootstrap: usage: --parent PID [...] -- PROGRAM ARGS")
    cut = argv.index("--")
    head, program = argv[:cut], argv[cut + 1 :]
    if len(head) % 2:
        raise SystemExit(f"zerotron.launcher.bootstrap: an option lacks its value: {head}")
    return dict(zip(head[::2], head[1::2], strict=True)), program


def cpus_of(options: dict[str, str], local_rank: int) -> set[int] | None:
    """The CPUs of local rank ``local_rank`` (``--cpus``), None: not bound."""
    if not options.get("--cpus"):
        return None
    return {int(c) for c in options["--cpus"].split(";")[local_rank].split(",")}


def command(options: dict[str, str], program: list[str], local_rank: int) -> list[str]:
    """What local rank ``local_rank`` execs: the interpreter with ``program``, through
    ``numactl --membind=N`` when ``--membind`` gives the rank a NUMA node."""
    run = [sys.executable, *program]
    nodes = options.get("--membind", "").split(";")
    node = nodes[local_rank] if local_rank < len(nodes) else ""
    if node and options.get("--numactl"):
        run = [options["--numactl"], f"--membind={node}", "--", *run]
    return run


def main(argv: list[str]) -> None:
    options, program = parse(argv)
    die_with_parent(int(options["--parent"]))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpus = cpus_of(options, local_rank)
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            raise SystemExit(
                f"zerotron launch: local rank {local_rank} cannot run on CPUs {sorted(cpus)}: "
                f"{e.strerror}"
            ) from None
    run = command(options, program, local_rank)
    os.execv(run[0], run)


if __name__ == "__main__":
    main(sys.argv[1:])
