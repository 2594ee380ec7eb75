"""Conversations to tokenized samples with loss masks, and samples to fixed-layout packs."""
