"""The tasks shipped with the SDK, so examples run with no downloads: the digit tasks on token
ids, the tiny text task and the tiny tool task.
"""
