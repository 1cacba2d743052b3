package pci

// ScanCounting is Scan that also counts the sysfs reads it made (files read, links read,
// directories listed or checked), for the benchmarks' reads-per-function figure.
func ScanCounting(root string) (*Tree, int, error) {
	n := 0
	t, err := scanner{root: root, seen: func(string, readKind, []byte) { n++ }}.scan()
	return t, n, err
}

// SetResources is Device.setResources, for the resource parser's table test and fuzz target.
func (d *Device) SetResources(text string) { d.setResources(text) }
