"""Draft-head training: ShareGPT / text data, target feature extraction, the EAGLE objective, export, plots."""
