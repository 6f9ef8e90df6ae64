"""How a run starts with the plugin: the launcher (``pretrain_gpt``), an unmodified Megatron script
(``run_script``), ``megatron-cg check``'s dry run on CPU (``dry_run``), ``--cg-preset`` flag sets
(``presets``) and single-process rendezvous (``rendezvous``)."""
