package dev.idempotency;

import java.io.File;
import java.net.URI;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import org.apache.iceberg.Files;
import org.apache.iceberg.io.FileIO;
import org.apache.iceberg.io.InputFile;
import org.apache.iceberg.io.OutputFile;
import org.apache.iceberg.io.PositionOutputStream;
import org.apache.iceberg.io.SeekableInputStream;

/**
 * A {@link FileIO} over the local file system ({@code file:} locations or plain paths), so the
 * client needs no Hadoop. It notes every file the client deletes: a client that takes a commit
 * for failed deletes the manifests it wrote, and the check asserts that this never happens.
 */
public class LocalFileIO implements FileIO {
  /** Every location the client deleted, in this JVM. */
  public static final List<String> DELETED = new CopyOnWriteArrayList<>();

  static File file(String location) {
    if (location.startsWith("file:")) {
      return new File(URI.create(location).getPath());
    }
    return new File(location);
  }

  @Override
  public InputFile newInputFile(String location) {
    InputFile local = Files.localInput(file(location));
    return new InputFile() {
      @Override
      public long getLength() {
        return local.getLength();
      }

      @Override
      public SeekableInputStream newStream() {
        return local.newStream();
      }

      @Override
      public String location() {
        return location;
      }

      @Override
      public boolean exists() {
        return local.exists();
      }
    };
  }

  @Override
  public OutputFile newOutputFile(String location) {
    File target = file(location);
    target.getParentFile().mkdirs();
    OutputFile local = Files.localOutput(target);
    return new OutputFile() {
      @Override
      public PositionOutputStream create() {
        return local.create();
      }

      @Override
      public PositionOutputStream createOrOverwrite() {
        return local.createOrOverwrite();
      }

      @Override
      public String location() {
        return location;
      }

      @Override
      public InputFile toInputFile() {
        return newInputFile(location);
      }
    };
  }

  @Override
  public void deleteFile(String location) {
    DELETED.add(location);
    file(location).delete();
  }
}
