"""Test doubles and strategies the unit tests share; nothing in the package imports them. The
tests import them as ``_doubles.<module>`` (pytest puts tests/unit on ``sys.path``)."""
