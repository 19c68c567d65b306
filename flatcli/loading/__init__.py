"""Loading models, checkpoints and data sets from config."""
