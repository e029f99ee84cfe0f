"""Data: record formats, chat templating + label masking, packing, the step sampler."""
