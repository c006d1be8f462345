"""Faust stream processing: joins, rewards, scorers, the history sink."""
