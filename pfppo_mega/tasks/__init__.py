from pfppo_mega.tasks.addition import AdditionTask, Problem
from pfppo_mega.tasks.tokenizer import Tokenizer, char_tokenizer

__all__ = ["AdditionTask", "Problem", "Tokenizer", "char_tokenizer"]
