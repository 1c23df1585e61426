"""Reward functions: their contract (named by import path, called per sample or per batch,
checked), built-in answer checks, and the text reward that decodes and scores samples.
"""
