"""The flags of ``zerotron launch``: one node's (torchrun's names, with DeepSpeed's aliases) and
the multi-node ones of DeepSpeed's ``deepspeed`` launcher (``--hostfile``, ``--include``, ...).

:mod:`zerotron.launcher.launch` turns them into one node's plan, and
:mod:`zerotron.launcher.multinode` into each node's command.
"""

from __future__ import annotations

import argparse

from zerotron.config.args import ArgumentParser

DEFAULT_MASTER_PORT = 29500  # torch's and DeepSpeed's
LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "slurm")  # how --hostfile starts the nodes


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="zerotron launch",
        description="Start a training program on several processes (and nodes) with "
        "torch.distributed's environment set, built on the elastic agent of torchrun. "
        "Everything after the script (or -m module) is passed to it untouched.",
    )
    p.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        "--num_gpus",
        "--num-gpus",
        dest="nproc_per_node",
        metavar="N",
        type=int,
        default=None,
        help="processes on this node (default: the number of GPUs, or 1 without CUDA; with "
        "--hostfile: use the first N slots of each host)",
    )
    p.add_argument(
        "--nnodes",
        "--num_nodes",
        "--num-nodes",
        dest="nnodes",
        metavar="N",
        type=int,
        default=None,
        help="number of nodes; start one launcher per node (with --hostfile: use its first N "
        "hosts; default 1, or every host of the hostfile)",
    )
    p.add_argument(
        "--node_rank",
        "--node-rank",
        dest="node_rank",
        metavar="I",
        type=int,
        default=None,
        help="this node's index, 0 .. nnodes-1 (node 0 hosts the rendezvous)",
    )
    p.add_argument(
        "--master_addr",
        "--master-addr",
        dest="master_addr",
        metavar="ADDR",
        default=None,
        help="address of node 0, reachable from every node (default: 127.0.0.1, or with "
        "--hostfile its first selected host)",
    )
    p.add_argument(
        "--master_port",
        "--master-port",
        dest="master_port",
        metavar="PORT",
        type=int,
        default=None,
        help=f"port on node 0 (default: a free port on one node, {DEFAULT_MASTER_PORT} on many)",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as python -m MODULE",
    )
    p.add_argument(
        "--no_local_rank",
        "--no-local-rank",
        dest="no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the program (LOCAL_RANK is always in its "
        "environment; zerotron's own commands never get the flag)",
    )
    p.add_argument(
        "--log_dir",
        "--log-dir",
        "--enable_each_rank_log",
        dest="log_dir",
        metavar="DIR",
        default=None,
        help="also write each rank's stdout and stderr to DIR/rank{N}.log",
    )
    p.add_argument(
        "--max_restarts",
        "--max-restarts",
        dest="max_restarts",
        metavar="N",
        type=int,
        default=0,
        help="restart all local workers this many times after a failure",
    )
    p.add_argument(
        "--shutdown_timeout",
        "--shutdown-timeout",
        dest="shutdown_timeout",
        metavar="S",
        type=int,
        default=15,
        help="after a rank fails, seconds the others get to exit on SIGTERM before SIGKILL",
    )
    p.add_argument(
        "--rdzv_timeout",
        "--rdzv-timeout",
        dest="rdzv_timeout",
        metavar="S",
        type=int,
        default=900,
        help="seconds to wait for all nodes to join",
    )
    p.add_argument(
        "--as_deepspeed",
        "--as-deepspeed",
        dest="as_deepspeed",
        action="store_true",
        help="in the program, `import deepspeed` is zerotron, with the distribution metadata "
        "that Hugging Face transformers and accelerate check (nothing is installed; a real "
        "DeepSpeed stays untouched)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show the elastic agent's own log messages"
    )
    _multinode_flags(p)
    _autotuning_flags(p)
    p.add_argument(
        "script",
        metavar="SCRIPT",
        nargs="?",  # checked in plan_from_args, for a message that says what to do
        help="the training script (or, with -m, the module) to run",
    )
    p.add_argument(
        "script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script"
    )
    return p


def _multinode_flags(p: ArgumentParser) -> None:
    """``--hostfile`` and the flags that go with it (DeepSpeed's names)."""
    p.add_argument(
        "-H",
        "--hostfile",
        metavar="FILE",
        default=None,
        help="run on the hosts of FILE (lines 'HOST slots=N'), one launcher per host",
    )
    p.add_argument(
        "-i",
        "--include",
        metavar="SPEC",
        default="",
        help='hosts and slots to use (default: all), e.g. "w0@w1:0,2": all of w0, slots 0 and 2 '
        "of w1",
    )
    p.add_argument(
        "-e",
        "--exclude",
        metavar="SPEC",
        default="",
        help='hosts and slots not to use (default: none), e.g. "w1:0"',
    )
    p.add_argument(
        "--launcher",
        type=str.lower,
        choices=LAUNCHERS,
        default="ssh",
        help="how the nodes' launchers are started",
    )
    p.add_argument(
        "--launcher_args",
        "--launcher-args",
        dest="launcher_args",
        metavar="ARGS",
        default="",
        help="extra arguments for ssh, pdsh, mpirun or srun, as one quoted string (default: none)",
    )
    p.add_argument(
        "--no_ssh",
        "--no-ssh",
        dest="no_ssh",
        action="store_true",
        help="start nothing remotely: run this host's share (--node_rank) of the hostfile's job; "
        "run the same command on every host",
    )
    p.add_argument(
        "--ssh_port",
        "--ssh-port",
        dest="ssh_port",
        metavar="PORT",
        type=int,
        default=None,
        help="port of sshd on every host (ssh and pdsh; default: ssh's own)",
    )
    p.add_argument(
        "--node_rank_env",
        "--node-rank-env",
        dest="node_rank_env",
        metavar="VAR",
        default=None,
        help="read --node_rank from environment variable VAR (set by mpirun or srun)",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print each node's command and exit without starting anything",
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _stages(text: str) -> list[int]:
    return [0, 1, 2, 3] if text.strip() == "all" else _int_list(text)


def _autotuning_flags(p: ArgumentParser) -> None:
    """``--autotuning tune|run`` (DeepSpeed's) and the limits of zerotron's search."""
    g = p.add_argument_group("autotuning (zerotron tune; docs/tune.md)")
    g.add_argument(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="find the fastest configuration with short timed experiments (the config's "
        '"autotuning" block says how); run: then train with it',
    )
    g.add_argument(
        "--zero_stages", "--zero-stages", dest="zero_stages", type=_stages, metavar="LIST",
        default=None,
        help="ZeRO stages to search, e.g. 0,1,2 or all (default: the config's "
        "zero_optimization.stage, which may be a list or 'all')",
    )
    g.add_argument(
        "--micro_batch_sizes", "--micro-batch-sizes", dest="micro_batch_sizes", type=_int_list,
        metavar="LIST", default=None,
        help="micro-batch sizes to search (default: DeepSpeed's choice up to the largest that "
        "fits)",
    )
    g.add_argument(
        "--tensor_parallel_sizes", "--tensor-parallel-sizes", dest="tensor_parallel_sizes",
        type=_int_list, metavar="LIST", default=None,
        help="zerotron pretrain: tensor-parallel sizes to search (default: all that divide)",
    )
    g.add_argument(
        "--pipeline_parallel_sizes", "--pipeline-parallel-sizes",
        dest="pipeline_parallel_sizes", type=_int_list, metavar="LIST", default=None,
        help="zerotron pretrain: pipeline-parallel sizes to search (default: all that divide)",
    )
    g.add_argument(
        "--recompute", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
        metavar="LIST", default=None,
        help="zerotron pretrain: recompute granularities to search, of none, selective, full "
        "(default: all three)",
    )
    g.add_argument(
        "--experiment_time_limit", "--experiment-time-limit", dest="experiment_time_limit",
        type=float, metavar="S", default=600.0,
        help="seconds an experiment may run before it is stopped and recorded as hung",
    )
    g.add_argument(
        "--device_memory", "--device-memory", dest="device_memory", metavar="SIZE",
        default=None,
        help="memory of one rank's device for pruning, e.g. 80GB (default: the GPU's, or the "
        "host's RAM over its local ranks)",
    )
