"""Datasets a job reads: files drawn in a seeded order, prompt and chat data, the tokenizer and
stop strings.
"""
