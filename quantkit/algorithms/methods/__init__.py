"""Each algorithm as one object (`quantkit.algorithms.base.Algorithm`), one module each: its recipe arguments, what
it needs and refuses, its preflight terms and its summary. Torch-free: recipes are checked without torch. The pure
math each one runs lives beside, in `quantkit.algorithms.<name>`; the list of these modules is
`quantkit.algorithms.METHODS`."""
