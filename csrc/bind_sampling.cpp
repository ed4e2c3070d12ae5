#include "bindings.h"
namespace mindie::host {
void bind_sampling(py::module_&) {}
}
