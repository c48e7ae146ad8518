package cgroupfs

import (
	"fmt"
	"os"
)

// writeControl writes one value to a control file that is written rarely
// (tiers, freezing, reclaim), so it is opened per write rather than kept
// open like the files of the sampling and actuation path.
func writeControl(path, v string) error {
	if err := os.WriteFile(path, []byte(v), 0); err != nil {
		return fmt.Errorf("write %q to %s: %w", v, path, classify(err))
	}
	return nil
}
