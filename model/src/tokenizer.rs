//! The checkpoint tokenizer and chat template.
