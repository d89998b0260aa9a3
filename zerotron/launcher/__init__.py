"""Starting jobs: ``zerotron launch`` runs a program as many ranks on one node or many.

- :mod:`zerotron.launcher.launch`: the command (flags, the worker command line, the elastic agent);
- :mod:`zerotron.launcher.output`: each rank's output, prefixed on the console and in its log;
- :mod:`zerotron.launcher.failures`: which rank failed first, its traceback and exit code.
"""
