"""Packed sequences (THD) under TE graphs (``--cg-thd-max-seqs``): the fixed-capacity layout
(``layout``), the graphs' sample inputs and replay translation (``graphs``) and the launcher's packed
batches (``batches``)."""
