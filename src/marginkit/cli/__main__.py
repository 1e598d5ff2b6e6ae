"""``python -m marginkit.cli``: the ``marginkit`` command (used by ``train --nproc`` under torchrun)."""

from marginkit.cli import main

raise SystemExit(main())
