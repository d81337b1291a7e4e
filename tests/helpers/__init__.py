"""Plain helpers shared by test modules: builders, references, the in-process server. No
fixtures and no tests here."""
