#include "bindings.h"
namespace mindie::host {
void bind_beam(py::module_&) {}
}
