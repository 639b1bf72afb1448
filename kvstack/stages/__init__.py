"""Stages: one file per stage (spec + behaviour). Every module here is imported by the registry on first use."""
