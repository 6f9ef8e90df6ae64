"""Capture machinery: the transaction, replay contracts, stream hygiene, and the one seam to TE."""
