"""Starting jobs: ``zerotron launch`` runs a program as many ranks on one node or many.

- :mod:`zerotron.launcher.launch`: the command (one node's plan, the worker command line, the
  elastic agent);
- :mod:`zerotron.launcher.flags`: its flags;
- :mod:`zerotron.launcher.hostfile`: hostfiles and --include/--exclude resource selection;
- :mod:`zerotron.launcher.slurm`: hosts, slots and node rank of a SLURM allocation;
- :mod:`zerotron.launcher.multinode`: each node's command per back end (ssh, pdsh, mpirun, srun);
- :mod:`zerotron.launcher.bootstrap`: what every worker runs first (dies with its launcher, binds
  its cores: :mod:`zerotron.launcher.binding`), then the program; ``--save_pid``:
  :mod:`zerotron.launcher.pidfile`;
- :mod:`zerotron.launcher.output`: each rank's output, prefixed on the console and in its log;
- :mod:`zerotron.launcher.failures`: which rank failed first, its traceback and exit code.
"""
