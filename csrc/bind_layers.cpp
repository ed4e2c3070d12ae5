#include "bindings.h"
namespace mindie::host {
void bind_layers(py::module_&) {}
}
