from gdn_jax.cli import main

raise SystemExit(main())
