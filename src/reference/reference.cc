// PLACEHOLDER: the float64 reference is being written.
namespace dsakit::reference {}
