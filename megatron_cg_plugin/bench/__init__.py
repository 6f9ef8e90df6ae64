"""``megatron-cg bench``: eager, Megatron's graphs and the plugin's interleaved in one process
(``command``), its pure step and block schedules and their statistics (``schedule``), and the JSON,
markdown and plot it writes (``output``)."""
