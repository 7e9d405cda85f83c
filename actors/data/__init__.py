"""Prompt datasets as every role reads them: loading and checking records (`prompts`), and a prompt's token ids
(`prompt_tokens`), computed one way for the buffer's length filter, the eval rounds and the rollout workers."""
