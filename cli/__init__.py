"""The `quantkit` command line (installed as `quantkit.cli`). Commands are thin adapters over the library."""
