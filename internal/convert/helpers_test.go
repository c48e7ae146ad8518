package convert

import (
	"io/fs"
)

func fsReadFile(f fs.FS, name string) ([]byte, error) { return fs.ReadFile(f, name) }
