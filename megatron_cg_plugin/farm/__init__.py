"""The functional farm (``megatron-cg farm``): eager against graphed training per case folder in
Megatron's ``model_config.yaml`` format (``runner``, ``cases``, ``case_adapt``), N local ranks through
``torch.distributed.run`` (``distributed``) on rendezvous ports that do not collide (``ports``)."""
