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
        metavar="N|MIN:MAX",
        action=NodeRange,
        default=None,
        help="number of nodes; start one launcher per node (with --hostfile: use its first N "
        "hosts; default 1, or every host of the hostfile). MIN:MAX (torchrun's form): elastic, "
        "as --min_nodes MIN --max_nodes MAX",
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
        help="after a rank or a node fails, restart the job this many times (on the nodes "
        "left, with --min_nodes); the program resumes from its newest checkpoint",
    )
    _elastic_flags(p)
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
        "--watchdog-timeout",
        "--watchdog_timeout",
        dest="watchdog_timeout",
        metavar="S",
        type=float,
        default=None,
        help="a rank that has waited S seconds in one collective reports what it waits in and "
        "its stack, and the launcher names the ranks that never arrived (default: a quarter of "
        "the process-group timeout, or $ZEROTRON_WATCHDOG_TIMEOUT; 0: off)",
    )
    p.add_argument(
        "--watchdog-action",
        "--watchdog_action",
        dest="watchdog_action",
        choices=("abort", "wait"),
        default=None,
        help="after the watchdog's summary: abort ends the job (exit code 124), wait keeps "
        "waiting (default: $ZEROTRON_WATCHDOG_ACTION or abort)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show the elastic agent's own log messages"
    )
    _multinode_flags(p)
    _process_flags(p)
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


class NodeRange(argparse.Action):
    """``--nnodes N`` or torchrun's ``--nnodes MIN:MAX`` (then also sets ``min_nodes``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        text = str(values)
        low, sep, high = text.partition(":")
        try:
            counts = (int(low), int(high)) if sep else (int(text), None)
        except ValueError:
            parser.error(f"{option_string}: expected N or MIN:MAX (whole numbers), got {text!r}")
        if sep:
            namespace.min_nodes = counts[0]
            setattr(namespace, self.dest, counts[1])
        else:
            setattr(namespace, self.dest, counts[0])


def _elastic_flags(p: ArgumentParser) -> None:
    """Elastic node counts and restarts (torchrun's and DeepSpeed's names)."""
    p.add_argument(
        "--min_nodes",
        "--min-nodes",
        "--min_elastic_nodes",
        "--min-elastic-nodes",
        dest="min_nodes",
        metavar="N",
        type=int,
        default=None,
        help="elastic: the job runs (and goes on after a node is lost) with at least N nodes "
        "(default: --nnodes, a fixed count)",
    )
    p.add_argument(
        "--max_nodes",
        "--max-nodes",
        "--max_elastic_nodes",
        "--max-elastic-nodes",
        dest="max_nodes",
        metavar="N",
        type=int,
        default=None,
        help="elastic: at most N nodes (default: --nnodes)",
    )
    p.add_argument(
        "--rdzv_conf",
        "--rdzv-conf",
        dest="rdzv_conf",
        metavar="K=V,...",
        default="",
        help="elastic: settings of torch's c10d rendezvous, e.g. last_call_timeout=10,"
        "keep_alive_interval=5,keep_alive_max_attempt=3 (seconds; the last two: a node that "
        "misses that many heartbeats is dropped)",
    )


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
        "--lifeline",
        choices=("stdin", "parent"),
        default=None,
        help="end this node's launcher, stopping its ranks, when its standard input closes "
        "(stdin) or its parent process exits (parent); the launching node sets it on the "
        "launchers it starts, so that they end with it or with the connection to it",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print each node's command and exit without starting anything",
    )


def _process_flags(p: ArgumentParser) -> None:
    """Core binding of the ranks and the launcher's PID file (DeepSpeed's names)."""
    p.add_argument(
        "--bind_cores_to_rank",
        "--bind-cores-to-rank",
        dest="bind_cores_to_rank",
        action="store_true",
        help="bind each local rank to an even, disjoint share of the node's cores (and its "
        "memory to their NUMA node, with numactl); OMP_NUM_THREADS is the share",
    )
    p.add_argument(
        "--bind_core_list",
        "--bind-core-list",
        dest="bind_core_list",
        metavar="CPUS",
        default=None,
        help='the CPUs to share out, e.g. "0-7,16-23" (implies --bind_cores_to_rank; default: '
        "every core the launcher may use)",
    )
    p.add_argument(
        "--save_pid",
        "--save-pid",
        dest="save_pid",
        action="store_true",
        help="write the PID of each node's launcher to /tmp/<PID>.zerotron, where <PID> is the "
        "process you started; removed when the launcher exits",
    )
    # Internal: the <PID> of --save_pid, given by the launching node to every node's launcher.
    p.add_argument(
        "--save_pid_as", dest="save_pid_as", type=int, default=None, help=argparse.SUPPRESS
    )
    p.set_defaults(allocation=None)  # hosts and slots of a SLURM allocation (launcher/slurm.py)


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
        "--zero_stages",
        "--zero-stages",
        dest="zero_stages",
        type=_stages,
        metavar="LIST",
        default=None,
        help="ZeRO stages to search, e.g. 0,1,2 or all (default: the config's "
        "zero_optimization.stage, which may be a list or 'all')",
    )
    g.add_argument(
        "--micro_batch_sizes",
        "--micro-batch-sizes",
        dest="micro_batch_sizes",
        type=_int_list,
        metavar="LIST",
        default=None,
        help="micro-batch sizes to search (default: DeepSpeed's choice up to the largest that "
        "fits)",
    )
    g.add_argument(
        "--tensor_parallel_sizes",
        "--tensor-parallel-sizes",
        dest="tensor_parallel_sizes",
        type=_int_list,
        metavar="LIST",
        default=None,
        help="zerotron pretrain: tensor-parallel sizes to search (default: all that divide)",
    )
    g.add_argument(
        "--pipeline_parallel_sizes",
        "--pipeline-parallel-sizes",
        dest="pipeline_parallel_sizes",
        type=_int_list,
        metavar="LIST",
        default=None,
        help="zerotron pretrain: pipeline-parallel sizes to search (default: all that divide)",
    )
    g.add_argument(
        "--recompute",
        type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
        metavar="LIST",
        default=None,
        help="zerotron pretrain: recompute choices to search, of none, selective, full, block "
        "(full recompute of the fewest layers per chunk that fit; default: all four)",
    )
    g.add_argument(
        "--experiment_time_limit",
        "--experiment-time-limit",
        dest="experiment_time_limit",
        type=float,
        metavar="S",
        default=600.0,
        help="seconds an experiment may run before it is stopped and recorded as hung",
    )
    g.add_argument(
        "--device_memory",
        "--device-memory",
        dest="device_memory",
        metavar="SIZE",
        default=None,
        help="memory of one rank's device for pruning, e.g. 80GB (default: the GPU's, or the "
        "host's RAM over its local ranks)",
    )
