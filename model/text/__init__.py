"""Text: the tokenizer, the incremental detokenizer and the chat template."""
