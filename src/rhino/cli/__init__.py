"""The ``rhino`` command line."""
