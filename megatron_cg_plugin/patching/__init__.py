"""Every change the plugin makes to Megatron, TE or torch state: the ledger with each change's reason
(``ledger``) and what each install-time patch puts in place (``builders``)."""
