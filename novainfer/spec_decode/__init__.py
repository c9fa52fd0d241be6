"""Speculative decoding: a proposer guesses the next tokens of each sequence, one target forward checks them.

    proposer.py             the interface the engine core calls after each step, and the factory
    ngram_proposer.py       prompt lookup: the tokens that followed the last earlier match of the suffix
    draft_model_proposer.py a small model with the same vocabulary, run by the worker (draft_model_runner.py)
    rejection_sampler.py    acceptance that keeps the target model's distribution (greedy: argmax match)
"""
