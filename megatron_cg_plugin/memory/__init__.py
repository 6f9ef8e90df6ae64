"""Graph memory shared across variants: slot ownership (and, later, arenas)."""
