"""`python -m supervisor.standin <sglang flags>`: the stand-in's main process."""

from supervisor.standin.server import main

raise SystemExit(main())
