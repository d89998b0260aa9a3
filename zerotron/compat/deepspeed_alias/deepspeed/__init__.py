"""``import deepspeed`` served by zerotron (``zerotron launch --as-deepspeed``).

This directory is put first on PYTHONPATH by :mod:`zerotron.compat.as_deepspeed`; it is never
installed. Every attribute is zerotron's (``deepspeed.initialize is zerotron.initialize``) and
every submodule ``deepspeed.X.Y`` is the module ``zerotron.X.Y`` itself; ``__version__`` is the
DeepSpeed release whose API zerotron serves, as in the ``.dist-info`` beside this package.
"""

from zerotron.compat.as_deepspeed import install_module_alias

__version__, __getattr__, __dir__ = install_module_alias(__name__)
