"""``python -m hf_sms.cli``: the ``hf-sms`` command."""

from . import main

raise SystemExit(main())
