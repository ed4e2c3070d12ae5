"""Plain-PyTorch references: one small readable function per kernel, the spec the C++ must meet."""
