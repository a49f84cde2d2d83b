"""Wire encodings and their error feedback, shared by every backend."""
