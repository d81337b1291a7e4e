"""specserve: the engine, server and CLI. ``specserve.kernels``, ``specserve.target``,
``specserve.draft`` and ``specserve.distill`` live in the folders beside this one and install
under this package (pyproject ``package-dir``), so nothing named ``kernels`` or ``draft`` lands
at the top of site-packages (Hugging Face's kernel hub package is called ``kernels``).
``make install`` installs a checkout in editable mode; ``tools/checkout.py`` runs another
checkout's code (a worktree, an old commit) from the same environment."""
