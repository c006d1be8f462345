"""The reward floor: what an episode is worth (``spec``: the reward spec and its arithmetic), and the scorers
that give it components beyond the user's decision — the LLM judge's client (``judge``) and the unit tests'
sandbox (``sandbox``), put together per episode by ``scoring``. The streams worker scores episodes with it;
the trainer's offline tools and the simulated users score with the same code."""
