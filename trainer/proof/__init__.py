"""Proof of learning: stdlib tasks, simulated users, held-out evaluation, offline training, the demo model
and the loop bench — the tools that show the trainer works, apart from the trainer itself."""
