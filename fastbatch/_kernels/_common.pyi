# Nothing public: the C-level helpers are for the pieces (cimport _common).
