"""Pure planning logic: no torch.cuda, runs anywhere, unit-tested exhaustively."""
