namespace dsakit {}
